"""The run itself: the trainer's stages (build, step, epoch, evaluate, checkpoint, close), the order in
which the model and its step are made, the step behind one interface whichever way gradients are
synced, the optimizer's half of a step, compiling, the learning-rate schedule, the run's budget of
steps, the warm-up, checkpoints and how a run ends."""
