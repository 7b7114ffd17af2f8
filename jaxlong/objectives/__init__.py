"""Training objectives: what a loss is made of, apart from the trainer that minimizes it.

* `jaxlong.objectives.base` — the `Objective` interface (batch spec, loss sums and their denominator, metrics,
  preparation) and the model calls every objective shares (the forward, per-token losses over sequence tiles).
* `jaxlong.objectives.lm` — language modelling: next-token cross-entropy (pretraining, context extension, SFT).
* `jaxlong.objectives.dpo` — DPO, IPO and SimPO on packed preference pairs; `jaxlong.objectives.reference` its
  reference log-probs, computed once.
* `jaxlong.objectives.registry` — the names a config gives (`objective: lm | dpo`).
"""
