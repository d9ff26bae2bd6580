"""acme-lplugins: an example lplugins plugin package."""
