"""Exit statuses of `meshlm` beyond 0 and 1 (a training failure, `cli.common.EXIT_TRAINING`)."""

# Exit statuses of `meshlm` that `meshlm launch` never retries (a restart would fail the same way):
EXIT_CONFIG = 2  # a ConfigError: bad input
EXIT_NONFINITE = 3  # a non-finite step stopped training (train.on_nonfinite); the last good state is saved
EXIT_MISMATCH = 4  # `meshlm check` / `train --check`: the layout's gradients differ from one device's
EXIT_NO_SPACE = 5  # the checkpoint directory is full (checkpoint.CheckpointSpace); committed steps are intact
FINAL_EXITS = {
    EXIT_CONFIG: "a configuration error",
    EXIT_NONFINITE: "a non-finite step (it would recur)",
    EXIT_MISMATCH: "a layout that differs from one device (meshlm check)",
    EXIT_NO_SPACE: "a full checkpoint directory (a restart would fill it again)",
}
