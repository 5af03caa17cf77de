"""p2pcoll's built-in collective strategies.

Each module is written only against :mod:`p2pcoll.strategy`, and each class is registered
through the ``p2pcoll.strategies`` entry-point group exactly like a third-party plugin.
"""
