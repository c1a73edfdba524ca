"""Hypothesis profiles: CI explores a fixed set of examples, so a landing never hinges on luck;
local runs explore new ones each time (`HYPOTHESIS_PROFILE=dev`)."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
