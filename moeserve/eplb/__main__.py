"""`python -m moeserve.eplb report|rebalance|simulate` (see moeserve.eplb.cli)."""

from __future__ import annotations

from moeserve.eplb.cli import main

raise SystemExit(main())
