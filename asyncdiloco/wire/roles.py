"""The gRPC metadata of a tier's Join: a regional server (ps/upstream.py) joins its
parent with ``adl-role: region``; a parent that averages regions' pseudo-gradients in
(θ ← θ − s(τ)·Δ/R over the R live regions, ps/apply.py) answers with the trailing
``adl-role: region-averaged``, so a regional server knows whether its parent does."""

#: The metadata key of a Join's role (request) and of the parent's answer (trailing).
ROLE_KEY = "adl-role"
#: The Join is a regional server's.
ROLE_REGION = "region"
#: The parent averages this region's pushes in.
REGION_AVERAGED = "region-averaged"
