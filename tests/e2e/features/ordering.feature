Feature: Out-of-order delivery never regresses a subscription
  Stripe does not deliver events in the order they happened. Whatever the order,
  the subscription, its invoices and entitlements end exactly as they would have
  had every event arrived in order: a stale event never overwrites a newer one.

  Scenario Outline: A lifecycle delivered out of order ends exactly where the in-order lifecycle ends
    Given two customers going through the same subscription lifecycle with <api> payloads: created, trialing, active, past_due, active, canceled, with invoices
    When Stripe delivers the first customer's events in order, each one processed before the next
    And Stripe delivers the second customer's events <order>
    Then every event of both customers ends processed
    And the second customer's subscription equals the first customer's
    And the second customer's invoices and entitlements equal the first customer's
    And each subscription's status is its last event's status, "canceled"
    And each subscription event is in the subscription's history exactly once

    Examples:
      | api       | order                                                                  |
      | pre-basil | in reverse order                                                       |
      | basil     | shuffled within a window of 4, with 30% duplicates and 20% sent as simultaneous copies |
