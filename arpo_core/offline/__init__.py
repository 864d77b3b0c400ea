"""Training from fixed data: scripted demonstrations (`demonstrations`), behaviour cloning
(`behaviour_cloning`), grounding pretraining (`grounding`) and the paper's offline baselines RFT, DPO
and KTO (`preference`)."""
