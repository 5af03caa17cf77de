"""The package list, which pyproject.toml alone cannot give setuptools: every package under
p2pcoll/ (found, so a new subpackage ships without editing anything) plus p2pcoll_plugins,
whose sources are in plugins/ (mapped in pyproject.toml). All other metadata is there."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[
        *find_namespace_packages(include=["p2pcoll", "p2pcoll.*"], exclude=["*.__pycache__"]),
        "p2pcoll_plugins",
    ]
)
