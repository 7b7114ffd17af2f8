"""Reinforcement learning on the training mesh (GRPO, `jaxlong.objectives.grpo`): the rewards (`rewards`). It sits
above training, generation and evaluation: rollouts are generation's, rewards score text as evaluation's RULER
metrics do, and training sees only the batches this floor builds."""
