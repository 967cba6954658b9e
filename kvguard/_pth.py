"""The start-up hook: ``kvguard.pth``, installed beside the package in site-packages.

Python's ``site`` module runs every line of a ``.pth`` file that starts with ``import`` when the
interpreter starts (coverage.py starts its subprocess measurement the same way). The line below
costs one ``os.environ`` lookup when ``KVGUARD`` is unset or off; set, it imports
``kvguard.staging`` and calls ``start()``, which reads the rest of the environment.

This module is also the setuptools build step that writes the file (``[tool.setuptools.cmdclass]``
in pyproject.toml names it): into the build tree for a wheel, straight into the editable wheel
for ``pip install -e``. kvguard itself never imports it.
"""

from __future__ import annotations

import os

from setuptools.command.build_py import build_py

PTH_NAME = "kvguard.pth"
PTH_LINE = ('import os; os.environ.get("KVGUARD", "").strip().lower() not in '
            '("", "0", "off", "false", "no") and __import__("kvguard.staging").staging.start()\n')


class BuildPyWithPth(build_py):
    """``build_py`` that also writes ``kvguard.pth`` to the root of what gets installed."""

    def run(self) -> None:
        super().run()
        directory = self._pth_directory()
        self.mkpath(directory)
        with open(os.path.join(directory, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def _pth_directory(self) -> str:
        if getattr(self, "editable_mode", False):
            # An editable wheel installs its unpacked directory as is: write the hook there.
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode: bool = True) -> list:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs
