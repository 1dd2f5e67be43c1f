"""The whole envd SDK suite (tests/envd/test_sdk.py), run against envd inside a real VM."""

from tests.envd.test_sdk import *  # noqa: F403
