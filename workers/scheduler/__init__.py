"""Continuous batching: which sequences run each step with how many tokens, who yields
(`scheduler`), the policies that order them and the preemption modes (`policy`), and fair share
between tenants (`fair_share`, the Virtual Token Counter).
"""
