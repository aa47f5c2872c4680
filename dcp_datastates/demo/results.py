"""What the scenario found: each run's records and the checks' results, handed to the report.

The scenario runs and checks; the report only prints. This is the one
value that passes between them, so the report needs nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses

from dcp_datastates.demo.checks import ContinuationCheck, ReplicaCheck, RootCheck
from dcp_datastates.demo.run_log import ckpts_of, losses_of


@dataclasses.dataclass
class RunOutcome:
    """One run as the parent sees it afterwards: rank 0's log records and the run's wall time."""

    records: list[dict]
    seconds: float

    @property
    def losses(self) -> dict[int, float]:
        return losses_of(self.records)

    @property
    def ckpts(self) -> dict[int, dict]:
        return ckpts_of(self.records)


@dataclasses.dataclass
class ScenarioResults:
    options: argparse.Namespace  # the command line (steps, failure step, process counts, ...)
    reference: RunOutcome
    failed: RunOutcome
    resumed: RunOutcome
    resume_step: int  # the newest committed checkpoint when the failing run died
    load_s: float  # how long the resumed run took to load it
    same_ckpt_text: str  # ours vs DCP's checkpoint of the resume step
    replica: ReplicaCheck
    continuation: ContinuationCheck
    root: RootCheck
    lost_steps: int  # steps the failing run finished after that checkpoint (recomputed on resume)
    problems: list[str]  # every check's, in the order they ran
