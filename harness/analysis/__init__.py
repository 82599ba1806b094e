"""Offline analysis tools that are not runtime: the availability model and time-to-train simulation
(`sim`) and the SPARe spare-placement planner and Monte-Carlo (`spare`), run by `ftrun sim`.

They live beside the emulator because they are models of a job, not code a training job runs; they
import only each other and the standard scientific stack, never ftrun's runtime, mocks or the engine.
"""
