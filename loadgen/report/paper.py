"""The paper's published figures that the report sets our measurements against (``docs/paper.md``).

Data only: the QPS bands of its Table 1 and their Turn 2 TTFT changes, the winner shares of its
Table 2, the failure rates of its Table 5, and the operating points of its Figure 6.
"""

from __future__ import annotations

from typing import Final

__all__ = ["BANDS", "HIGH_QPS", "PAPER_FIGURE6_LOCAL", "PAPER_TABLE1", "PAPER_TABLE2", "PAPER_TABLE5"]

BANDS: Final = (("low", 0.5, 2.0), ("medium", 4.0, 8.0), ("high", 12.0, 20.0))
HIGH_QPS: Final = (8.0, 12.0, 16.0, 20.0)
#: The paper's Table 1: change in Turn 2 TTFT from x=0 to x=1 per QPS band (low, medium, high).
PAPER_TABLE1: Final[dict[str, tuple[float, float, float]]] = {
    "1P3D": (-0.578, -0.652, -0.733),
    "2P2D": (-0.477, -0.516, -0.562),
    "3P1D": (-0.443, -0.381, -0.249),
}
#: The paper's Table 2: per mode category, the share of its (workload, QPS) combinations (4 GPUs, 18
#: workloads, 10 QPS levels) won on lowest Turn 2 TTFT, lowest TPOT and highest throughput, among all its
#: 17 configurations (the hybrid ones, left out here, won the rest).
PAPER_TABLE2: Final[dict[str, tuple[float, float, float]]] = {
    "Replica": (0.633, 0.006, 0.0),
    "x=0 (pd)": (0.0, 0.383, 0.044),
    "0<x<1 (fraction)": (0.033, 0.333, 0.278),
    "x=1 (local)": (0.272, 0.156, 0.383),
}
#: The paper's Table 5: failure rates at QPS 8, 12, 16, 20 per (shape, mode).
PAPER_TABLE5: Final[dict[tuple[str, str], tuple[float, float, float, float]]] = {
    ("3P1D", "pd"): (0.11, 0.44, 0.61, 0.89),
    ("3P1D", "local"): (0.06, 0.22, 0.44, 0.67),
    ("2P2D", "pd"): (0.0, 0.06, 0.11, 0.22),
    ("2P2D", "local"): (0.0, 0.0, 0.06, 0.11),
}
#: The paper's Figure 6 operating points (1P3D, prefill-heavy, QPS 8 and 16): w_tpot -> share routed
#: locally (static PD is 0%).
PAPER_FIGURE6_LOCAL: Final = {1.0: 0.95, 3.0: 0.50, 6.0: 0.20}
