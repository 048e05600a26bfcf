"""A second set for bench.quality.structured_quality, written blind (issue 59): on 2026-11-29, before any
of it was run against any server and without reading which requests failed on the first set.
Users' own phrasing: no system message, the request itself says what to extract. Pydantic models
as extraction code writes them (nested models, lists of models, optional and defaulted fields,
enums, literals, numbers without bounds), and `json_object` requests whose prompt names no keys
or some."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel


class Genre(str, Enum):
    fiction = "fiction"
    science = "science"
    history = "history"


class Author(BaseModel):
    first_name: str
    last_name: str


class Novel(BaseModel):
    title: str
    author: Author
    year: int
    genre: Genre


class Ingredient(BaseModel):
    name: str
    amount: str


class Dish(BaseModel):
    name: str
    ingredients: list[Ingredient]
    vegetarian: bool


class Patient(BaseModel):
    name: str
    age: int
    allergies: list[str] = []
    blood_type: Literal["A", "B", "AB", "O"] | None = None


class Hotel(BaseModel):
    name: str
    city: str
    stars: int
    price_per_night: float


class Booking(BaseModel):
    guest: str
    hotel: Hotel
    nights: int


class Song(BaseModel):
    title: str
    seconds: int


class Album(BaseModel):
    artist: str
    title: str
    songs: list[Song]


class Ticket(BaseModel):
    id: str
    severity: Literal["minor", "major", "critical"]
    summary: str
    assignee: str | None = None


class Transaction(BaseModel):
    date: str
    amount: float
    currency: str
    merchant: str


class Statement(BaseModel):
    account: str
    transactions: list[Transaction]


class Job(BaseModel):
    title: str
    company: str
    remote: bool
    salary: int | None = None
    skills: list[str]


class Coordinates(BaseModel):
    latitude: float
    longitude: float


class Landmark(BaseModel):
    name: str
    location: Coordinates
    built: int


class Student(BaseModel):
    name: str
    grades: dict[str, int]


class Step(BaseModel):
    order: int
    instruction: str


class Guide(BaseModel):
    goal: str
    steps: list[Step]


class Weekday(str, Enum):
    monday = "monday"
    tuesday = "tuesday"
    wednesday = "wednesday"
    thursday = "thursday"
    friday = "friday"


class Shift(BaseModel):
    worker: str
    day: Weekday
    start: str
    end: str


BLIND_SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Novel, "Extract the book: Dune by Frank Herbert, a science fiction novel from 1965."),
    (Dish, "Omelette: 2 eggs, a pinch of salt and 10 g of butter. No meat."),
    (Patient, "Patient Maria Lopez, 34, is allergic to penicillin."),
    (Booking, "Book 3 nights for Sam Lee at the Grand Hotel in Rome, 4 stars, 180 euros a night."),
    (Album, "The album Abbey Road by The Beatles opens with Come Together (259 s) and Something (182 s)."),
    (Ticket, "Ticket INC-204: the login page is down for everyone. This is critical."),
    (Statement, "Account 1234: on 2025-03-02 I paid 12.50 USD at Cafe Luna and 40 USD at Gas Stop."),
    (Job, "We are hiring a remote Python developer at DataCorp. Skills: Python, SQL."),
    (Landmark, "The Eiffel Tower, at 48.8584 N 2.2945 E, was built in 1889."),
    (Student, "Lena scored 90 in math and 85 in physics."),
    (Guide, "How do I boil an egg? Give the steps."),
    (Shift, "Omar works on Tuesday from 09:00 to 17:00."),
]

JSON_OBJECT_PROMPTS = (
    "Return a JSON object describing the planet Mars.",
    "Convert to JSON: name Alice, city Paris, age 30.",
    "List the days of the weekend as a JSON object.",
    "Give me a JSON object with a title and a short summary of the story of Cinderella.",
)
