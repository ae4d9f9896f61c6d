"""The build hook pyproject.toml cannot express: the cffi extensions, compiled by setuptools
(``cffi_modules``) so that ``pip install .`` and every wheel carry them.  All other metadata
lives in pyproject.toml; native/build.py defines the extensions."""

import runpy

from setuptools import setup

BUILD_FILE = "native/build.py"

setup(cffi_modules=runpy.run_path(BUILD_FILE)["cffi_modules"](BUILD_FILE))
