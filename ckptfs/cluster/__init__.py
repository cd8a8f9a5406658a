"""What nodes agree on through the store: seal leases, gc, retention, stale staged trees."""
