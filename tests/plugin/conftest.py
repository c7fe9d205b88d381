"""Every plugin test starts and ends with mlx-lm's own functions in place."""

import pytest

from mlx_spec import plugin


@pytest.fixture(autouse=True)
def _plugin_off():
    plugin.disable()
    yield
    plugin.disable()
