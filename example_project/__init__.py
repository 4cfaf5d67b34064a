"""An example Django project that puts django-quota in front of a small DRF API."""
