"""Python models' own metrics (Triton's `pb_utils.MetricFamily`), as they ride in a worker's
heartbeat to the gateways that export them beside the nv_* families.

Workers keep them, gateways add the fleet's up: both sides read this form. In a heartbeat's
`info`, under INFO_KEY, a list of families, each
`{"name", "kind", "help", "series": [[labels, value, at_ms], ...]}`: `labels` a mapping of
strings, `at_ms` when the value last changed, and `value` a number, or for a histogram
`{"bounds": [upper bounds, ascending], "counts": [per bucket, one more for +Inf], "sum"}`.
"""

from __future__ import annotations

from typing import Literal

INFO_KEY = "custom_metrics"
Kind = Literal["counter", "gauge", "histogram"]
KINDS: tuple[Kind, ...] = ("counter", "gauge", "histogram")
#: prefixes of the server's own families, which a model's family may not take.
RESERVED_PREFIXES = ("nv_", "sluice_")
#: what one model may create in a worker, so that a model minting label sets per request
#: cannot grow the heartbeat and the metrics page without bound.
MAX_FAMILIES_PER_MODEL = 64
MAX_SERIES_PER_MODEL = 1024
#: the longest name, label name or label value kept.
MAX_TEXT = 256
