"""Layer 3: propagation of perturbations and its metrics, decay fits, token Jacobians."""

from .propagate import DecayFit, Propagation, fit_decay, propagate, token_jacobians
