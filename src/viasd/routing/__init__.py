"""Routes: which layers of the verifier a slim verifier or a drafting pass runs."""

from viasd.routing.route import ModelFingerprint, Route, RouteError, shipped_route

__all__ = ["ModelFingerprint", "Route", "RouteError", "shipped_route"]
