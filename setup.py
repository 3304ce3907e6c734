"""The package list for setuptools; everything else is in pyproject.toml.

pyproject.toml can either list packages or search for them, not both: the
search finds kvlab and its subpackages, and the assets folder at the
repository's top level is added as the data package kvlab.assets.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kvlab", "kvlab.*"]), "kvlab.assets"])
