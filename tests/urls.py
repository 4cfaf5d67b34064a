from django.http import HttpRequest, HttpResponse
from django.urls import include, path


def ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


api = [
    path("items/", ok, name="items"),
    path("search/", ok, name="search"),
]

urlpatterns = [
    path("api/", include((api, "api"))),
    path("apiary/", ok, name="apiary"),
    path("health/", ok, name="health"),
    path("plain/<int:pk>/", ok),
]
