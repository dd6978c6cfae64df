"""The arithmetic a layer's statistics share between where they are computed (the host, ``extract.store.stats``,
or the device, ``extract.capture.block_stats``): rows are summed in float32 in blocks of ``BLOCK_ROWS``
from each chunk's first row (docs/store-format.md, "Statistics")."""

from __future__ import annotations

BLOCK_ROWS = 16
FLOAT16_MAX = 65504.0
