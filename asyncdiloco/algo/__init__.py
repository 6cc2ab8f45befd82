"""The algorithms both sides share: the outer optimizers (DiLoCo's Nesterov, Delayed
Nesterov), learning-rate schedules, DyLU and the grouping window. Pure torch; imports
only ``errors``.
"""
