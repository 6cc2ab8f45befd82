"""The gRPC metadata of a tier's Join: a regional server (ps/tier/upstream.py) joins its
parent with ``adl-role: region``, and the parent averages that region's pseudo-gradients
in (θ ← θ − s(τ)·Δ/R over the R live regions, ps/push/apply.py)."""

#: The metadata key of a Join's role.
ROLE_KEY = "adl-role"
#: The Join is a regional server's.
ROLE_REGION = "region"
