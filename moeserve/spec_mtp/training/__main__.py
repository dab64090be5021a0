"""`python -m moeserve.spec_mtp.training --out DIR [...]` (see moeserve.spec_mtp.training.train)."""

from __future__ import annotations

from moeserve.spec_mtp.training.train import main

raise SystemExit(main())
