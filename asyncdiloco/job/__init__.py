"""The default training job: the character-level transformer, the embedded corpus and its
batches, and the job's configuration. Imports no worker or server code.
"""
