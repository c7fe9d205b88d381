"""The one build step pyproject.toml cannot state: ``mlx_spec_plugin.pth``
goes into the wheel's root, which installs into site-packages, where Python
reads it at start-up (the ``MLX_SPEC_PLUGIN=1`` switch, docs/plugin.md).
An editable install does not carry it: ``python -m mlx_spec.plugin
--install-hook`` writes it there."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "mlx_spec_plugin.pth"


class BuildPyWithHook(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            here = os.path.dirname(os.path.abspath(__file__))
            self.copy_file(os.path.join(here, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithHook})
