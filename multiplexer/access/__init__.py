"""Who may do what: the admin key, keys and teams as data, OAuth tokens.

The gateway sees this room only as decisions at admission; faces use it to guard `/admin/`."""
