"""logra-pl."""
