"""Adapters: implementations of the ports, one sub-package per external system.

Nothing heavy is imported here; each adapter imports its package inside its own module.
"""
