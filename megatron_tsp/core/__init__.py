"""The TSP core: layout, parallel state, communication, layers, specs.

Imports only torch, megatron.core and itself (see docs/design.md)."""
