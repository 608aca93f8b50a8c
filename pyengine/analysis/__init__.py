"""Layer 3: propagation of perturbations and its metrics, decay fits, token Jacobians."""

from .block_spectra import BlockJacobian, block_jacobian_norm
from .decay import DecayFit, fit_decay
from .jacobians import token_jacobians
from .stability import SignalPropagation, mlp_stack, signal_propagation
from .stack_stability import stack_signal_propagation
from .weight_spectra import WeightSpectra, weight_spectra
from .propagate import Propagation, position_mask, propagate, resolve_positions
from .site_spectra import SiteSpectra, norm_site_inputs, site_spectra
from .token_spectra import TokenJacobian, TokenSpectra, token_jacobian_spectra
