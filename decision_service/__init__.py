"""decision_service."""
