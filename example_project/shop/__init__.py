"""The example shop: items and an expensive search, behind django-quota policies."""
