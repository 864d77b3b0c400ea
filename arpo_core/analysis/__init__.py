"""Reading what a policy does: evaluation with intervals (`evaluation`), image-dependence probes
(`probe`), comparison tables and plots (`report`), multi-seed study statistics (`study`) and the HTML
trajectory viewer (`viewer`)."""
