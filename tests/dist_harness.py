"""One rank of a data-parallel harness run (tests/test_distributed.py), started by torch's launcher:

    python tests/dist_harness.py POLICY_DIR OUT EPOCHS ENGINE ZERO MICRO MINI [RANK EPOCH ITERATION [stop]]

It trains with tests/trainer_harness.py's fake pool and seeded replies on this rank's share; with the
RANK arguments that rank SIGKILLs itself (with `stop`: hangs, asleep, and the collective timeout is 20 s
instead of 120 s) once it reports the update phase of that iteration.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import trainer_harness as harness


def main(argv: list[str]) -> None:
    import torch

    from arpo_core.algorithm import trainer
    from arpo_core.algorithm.distributed import Heartbeat, Ranks

    torch.set_num_threads(1)
    policy_dir, out, epochs, engine, zero, micro, mini = argv[:7]
    hang = argv[10:] == ["stop"]
    ranks = Ranks.from_env(timeout_s=20 if hang else 120, backend="auto")
    if len(argv) > 7:
        kill = (int(argv[7]), int(argv[8]), int(argv[9]))

        class Dying(Heartbeat):
            def __call__(self, epoch, iteration, phase):
                super().__call__(epoch, iteration, phase)
                if (self.rank, epoch, iteration) == kill and phase == "update":
                    if hang:
                        time.sleep(3600)  # a hung rank: alive, silent
                    os.kill(os.getpid(), signal.SIGKILL)

        trainer.Heartbeat = Dying
    cfg, pc = harness.configs(
        int(epochs),
        engine=engine,
        zero_stage=int(zero),
        micro_batch_size=int(micro),
        mini_batch_size=int(mini),
    )
    harness.run(policy_dir, out, cfg, pc, ranks=ranks, heartbeat_dir=Path(out) / "ranks")
    ranks.close()  # after a run that ended well (arpo_core/algorithm/distributed.py, decision "Clean exit")


if __name__ == "__main__":
    main(sys.argv[1:])
