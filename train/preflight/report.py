"""The preflight report (``runs/NAME/preflight.json``) and the error a failed preflight raises."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from train.errors import TrainError


@dataclass
class CheckResult:
    name: str
    ok: bool
    seconds: float = 0.0
    detail: str = ""
    culprits: list[str] = field(default_factory=list)
    # measured figures a caller acts on (the throughput check's tokens/s), by name
    values: dict[str, float] = field(default_factory=dict)


@dataclass
class PreflightReport:
    ok: bool
    device: str
    dtype: str
    torch_version: str
    checks: list[CheckResult]

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [f"preflight on {self.device} ({self.dtype}, torch {self.torch_version})"]
        for c in self.checks:
            mark = "PASS" if c.ok else "FAIL"
            lines.append(f"  {mark}  {c.name:<21} {c.seconds:6.2f} s  {c.detail}")
            for cul in c.culprits[:12]:
                lines.append(f"          ↳ {cul}")
            if len(c.culprits) > 12:
                lines.append(f"          ↳ … and {len(c.culprits) - 12} more")
        lines.append("preflight: " + ("all checks passed" if self.ok else "FAILED — the run will not start"))
        return "\n".join(lines)

    def summary(self) -> str:
        """What the run's log gets once the checks are done (each check already printed its line as it ran): one
        line when every check passed, the whole :meth:`table` (culprits included) when one failed."""
        if not self.ok:
            return self.table()
        seconds = sum(c.seconds for c in self.checks)
        return (f"preflight on {self.device} ({self.dtype}, torch {self.torch_version}): all {len(self.checks)} checks "
                f"passed in {seconds:.0f} s")


class PreflightFailed(TrainError):
    """A check failed: the run does not start (exit code 1; the report names the culprits)."""

    exit_code = 1
