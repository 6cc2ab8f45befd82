"""The settings of the server and the workers, each declared once as a command-line flag
(settings.py: the tables; table.py: the machinery). Sits above ``ps``, ``worker`` and
``job`` (it names their config fields) and below ``bench`` and ``cli``.
"""
