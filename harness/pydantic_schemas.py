"""Twenty Pydantic models of the kinds extraction pipelines ask for (nested objects, enums, arrays,
optional fields, literals, numbers, bounds), each with a prompt a small model can answer. Some
carry bounds (maxItems, maximum) as real extraction schemas do: SmolLM2-135M otherwise repeats a
list item or a digit until max_tokens on a few of them (valid JSON so far, never finished).

HELD_OUT_SCHEMAS: twelve more, written after the grammar's settings were chosen (issue 40) and
without bounds, as users write them: numbers with no minimum or maximum, lists with no length,
optional fields (`X | None = None`), arrays of objects, nested objects, enums, booleans, a literal.
bench.quality.structured_quality sends both lists; the tests send the twenty."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field

# The system message every structured request here is sent with (tests and bench.quality.structured_quality).
SYSTEM = {"role": "system", "content": "Answer in JSON."}


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str
    age: int


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0, le=100_000_000)


class Address(BaseModel):
    street: str
    city: str
    zip_code: str


class Employee(BaseModel):
    name: str
    address: Address


class Paint(BaseModel):
    color: Color
    liters: float


class ShoppingList(BaseModel):
    items: list[str]


class Book(BaseModel):
    title: str
    author: str
    year: int | None


class Weather(BaseModel):
    city: str
    temperature_celsius: float
    condition: Literal["sunny", "cloudy", "rainy", "snowy"]


class Answer(BaseModel):
    answer: bool
    confidence: float


class Point(BaseModel):
    x: int
    y: int


class Polygon(BaseModel):
    name: str
    points: list[Point] = Field(max_length=4)


class Movie(BaseModel):
    title: str
    genres: list[Literal["action", "comedy", "drama", "horror", "romance"]]
    rating: float


class Pet(BaseModel):
    name: str
    species: Literal["cat", "dog", "bird"]
    nickname: str | None


class Order(BaseModel):
    order_id: int
    quantities: list[int]
    paid: bool


class Country(BaseModel):
    name: str
    capital: str
    languages: list[str] = Field(min_length=1, max_length=3)


class Recipe(BaseModel):
    dish: str
    ingredients: list[str] = Field(max_length=6)
    minutes: int = Field(ge=0, le=600)


class Team(BaseModel):
    name: str
    members: list[Person]


class Sentiment(BaseModel):
    text: str
    label: Literal["positive", "negative", "neutral"]


class Event(BaseModel):
    title: str
    date: str
    attendees: int


class Profile(BaseModel):
    username: str
    email: str | None
    favorite_color: Color
    tags: list[str]


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Person, "Alice is 30 years old. Give her name and age."),
    (City, "Describe Paris: its name, country and population."),
    (Employee, "Bob lives at 12 Main Street, Springfield, zip 12345."),
    (Paint, "I need 2.5 liters of blue paint."),
    (ShoppingList, "Make a shopping list with milk, eggs and bread."),
    (Book, "The book 1984 was written by George Orwell in 1949."),
    (Weather, "It is 21 degrees and sunny in Rome."),
    (Answer, "Is the sky blue? Answer with your confidence."),
    (Point, "Give the point with x 3 and y 4."),
    (Polygon, "A triangle with points (0,0), (1,0) and (0,1)."),
    (Movie, "The movie Titanic is a romance and drama rated 7.9."),
    (Pet, "My cat is called Tom."),
    (Order, "Order 42 has quantities 1, 2 and 3 and is paid."),
    (Country, "France: capital Paris, language French."),
    (Recipe, "Pancakes need flour, milk and eggs and take 20 minutes."),
    (Team, "Team Blue has Ann, 25, and Ben, 31."),
    (Sentiment, "Classify the sentiment of: I love this phone."),
    (Event, "The concert is on 2025-06-01 with 500 attendees."),
    (Profile, "User jdoe likes green and is tagged admin and staff."),
    (Person, "Describe a person called Carol who is 41."),
]


# -- held out (issue 40): no bounds anywhere ------------------------------------------------------
class Priority(str, Enum):
    low = "low"
    medium = "medium"
    high = "high"


class CountryStats(BaseModel):
    name: str
    capital: str
    population_millions: float


class QuestionAnswer(BaseModel):
    question: str
    answer: str


class Product(BaseModel):
    name: str
    price: float
    in_stock: bool
    tags: list[str]


class Customer(BaseModel):
    name: str
    email: str | None = None


class LineItem(BaseModel):
    description: str
    quantity: int
    unit_price: float


class Invoice(BaseModel):
    invoice_id: int
    customer: Customer
    lines: list[LineItem]
    total: float


class Task(BaseModel):
    title: str
    priority: Priority
    done: bool
    due_date: str | None = None


class Flight(BaseModel):
    airline: str
    flight_number: str
    origin: str
    destination: str
    status: Literal["on time", "delayed", "cancelled"]


class Review(BaseModel):
    product: str
    stars: int
    pros: list[str]
    cons: list[str]
    recommended: bool


class Company(BaseModel):
    name: str
    city: str | None = None


class Contact(BaseModel):
    name: str
    phone: str | None = None
    company: Company | None = None


class Room(BaseModel):
    building: str
    number: int


class Meeting(BaseModel):
    topic: str
    participants: list[str]
    duration_minutes: int
    room: Room
    online: bool


class Car(BaseModel):
    make: str
    model: str
    year: int
    color: Color
    electric: bool


class Planet(BaseModel):
    name: str
    moons: int
    has_rings: bool
    distance_from_sun_km: float


class Readings(BaseModel):
    sensor: str
    values: list[float]
    unit: Literal["celsius", "fahrenheit"]


HELD_OUT_SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (CountryStats, "Japan's capital is Tokyo and it has about 125 million people."),
    (QuestionAnswer, "What is the capital of Italy?"),
    (Product, "The red mug costs 8.99 dollars, is in stock, and is tagged kitchen and gift."),
    (Invoice, "Invoice 7 for Jane Doe: 2 pens at 1.50 each and 1 notebook at 4.00, total 7.00."),
    (Task, "Add a high priority task to pay the rent by 2025-07-01. It is not done yet."),
    (Flight, "Flight BA 117 of British Airways from London to New York is delayed."),
    (Review, "I give the headphones 4 stars: great sound, but the battery is weak. I recommend them."),
    (Contact, "Save Tom Smith, phone 555-0100, who works at Acme in Boston."),
    (Meeting, "Plan a 30 minute budget meeting with Ann and Raj in room 12 of building B, not online."),
    (Car, "My car is a blue 2020 Tesla Model 3, which is electric."),
    (Planet, "Saturn has 146 moons, has rings, and is 1.4 billion km from the Sun."),
    (Readings, "The kitchen sensor read 20.5, 21.0 and 21.5 degrees Celsius."),
]
