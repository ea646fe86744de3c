"""Fault drills: the drill itself, its fault proxy, segment archive, history checker and report."""
