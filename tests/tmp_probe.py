import dataclasses
from ddpcheck.targets.lightning import LightningTarget
@dataclasses.dataclass(frozen=True)
class Probe(LightningTarget):
    def fit(self, module, run):
        run.loss = staticmethod(lambda o, y, s: ((o - y) ** 2).sum() * s * 0.5)
        super().fit(module, run)
