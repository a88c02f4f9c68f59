"""How a step changes the weights: the optimizers, the learning-rate schedule, the compiled train
and eval steps, and the state they work on (the model with its adapters, and the optimizer).

`optimizer` (AdamW, Muon), `lr_schedule` (warm-up, hold, cosine), `steps` (the compiled train
and eval steps), `state` (the model and optimizer a run trains, with LoRA adapters where it
asks for them: checked, built, started from another run's weights). The trainer
(`minigpt.train`) runs these step after step; the planner (`minigpt.plan`) reads their shapes
and compiles the same step to check its estimates.
"""
