"""Shared by every test: torch's lazy imports done once, before the first test, so that no single test's time
holds them (building the first optimizer imports torch._dynamo: about 800 modules, seconds on a loaded core)."""

import torch._dynamo  # noqa: F401
