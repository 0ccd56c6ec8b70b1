Feature: Duplicate deliveries are acknowledged and change nothing
  Stripe may deliver an event more than once, and copies may arrive at the same time.
  Each copy gets a 2xx, and the event's business effect happens once.

  Scenario: A duplicate of a processed event is acknowledged and changes nothing
    Given an invoice.paid event has been delivered and processed
    When Stripe delivers the same event again
    Then Stripe's delivery is acknowledged as a duplicate
    And no worker is woken for it
    And the business rows are exactly as they were
    And the event was attempted only once

  Scenario: Copies of an event arriving at the same time are applied once
    When Stripe delivers 8 copies of an invoice.paid event at the same moment
    Then every copy is acknowledged
    And exactly one copy is recorded as new and the others as duplicates
    And the event ends processed
    And the credits for the invoice are granted exactly once
    And the event was attempted only once
