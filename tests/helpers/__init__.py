"""Support code for the reliability tests: subprocess harness, worker scripts, tiny scenarios.

Worker scripts (`*_worker.py`) run as `python tests/helpers/<name>.py ...` in fresh processes, so
they can configure TensorFlow before it initialises (logical devices, TF_CONFIG) and so a crash or
a SIGKILL in them is observed from outside instead of taking the test process down.
"""
