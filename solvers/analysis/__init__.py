"""Analyses of a Plan on its Problem: the peak memory model, the host link model, the graph facts planners share.

They sit above the records (``problem``, ``status``, ``tags``) and import none of the planners.
"""
