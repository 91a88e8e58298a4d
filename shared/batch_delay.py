"""How long a partial batch waits: "fixed" waits its model's delay out, as Triton does;
"adaptive" (opt-in) skips the wait while the model's requests arrive further apart than it.

Named once for a model's BATCH_DELAY parameter and the server's --batch-delay; kept out of
model_config.py so that settings read it without loading the config parser.
"""

from typing import Literal, get_args

BatchDelay = Literal["fixed", "adaptive"]
DELAY_MODES: tuple[BatchDelay, ...] = get_args(BatchDelay)
