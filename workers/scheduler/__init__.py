"""Continuous batching: which sequences run each step with how many tokens (`scheduler`), who
yields when a step runs short (`victims`) and how it yields: recompute, swap or move
(`preemption`); the policies that order sequences and the preemption modes (`policy`), and fair
share between tenants (`fair_share`, the Virtual Token Counter).
"""
