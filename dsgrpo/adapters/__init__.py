"""Environments from other libraries in `environment_factory`'s shape (reset(**row) -> str, public methods as tools,
get_reward()). Each adapter imports its library only when an episode starts, so dsgrpo never needs it installed.

- textarena.py: TextArena's single-player games (`textarena` on the package registry), played offline.
"""
