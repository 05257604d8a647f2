"""Generate sample_docs/handbook.pdf, a fictional staff handbook written for this project.

Deterministic: the same text, layout and metadata on every run. Only core fonts (Helvetica) are
used, so the text is latin-1. Run from the repository root:

    python scripts/make_sample_docs.py
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from fpdf import FPDF

OUT = Path(__file__).resolve().parent.parent / "sample_docs" / "handbook.pdf"
TITLE = "Brackwater Cartography Cooperative - Staff Handbook 2025"

# One entry per page: a list of (heading, paragraphs). Each page must fit on one PDF page.
PAGES: list[list[tuple[str, list[str]]]] = [
    [
        (
            "Welcome to Brackwater",
            [
                "Brackwater Cartography Cooperative makes maps, nautical charts and survey data "
                "for harbour authorities, walking clubs, regional councils and anyone else who "
                "needs to know exactly where the ground ends and the water begins. This handbook "
                "explains how we work together: the hours we keep, the way we are paid, the "
                "buildings we share and what to do when something goes wrong. Read it in your "
                "first week and keep it nearby afterwards. If something here is unclear or out of "
                "date, tell the People Office so the next edition can be better.",
                "The founder of Brackwater is Agnes Ruthven, a surveyor who had spent eleven "
                "years drawing tide tables for the port of Tessaly Ford and decided that the "
                "small harbours along the coast deserved charts as careful as the big ones. "
                "Brackwater was founded in 1987. She started with two colleagues, a borrowed "
                "theodolite and a rented room above a bakery on Mill Lane. The bakery has since "
                "closed, but the room is still ours: it is now the reading room of the map "
                "library.",
                "Today Brackwater employs 142 people. Everyone who has completed one year of "
                "service may become a member of the cooperative, which means a vote at the annual "
                "general meeting and a share of the surplus at the end of the financial year. "
                "Membership is optional and costs a one-time fee of 50 EUR, which is returned if "
                "you leave.",
            ],
        ),
        (
            "Where we are",
            [
                "Our head office is at 14 Larkspur Quay, Tessaly Ford, a converted rope warehouse "
                "on the north bank of the river Wend. The field survey team works from a second "
                "site, the Gannet Point depot, about forty minutes up the coast, where the boats, "
                "drones and vehicles are kept. A small sales office in the city of Corrandale "
                "looks after our largest customers and is staffed on weekdays only.",
                "The current managing director is Odile Fenwick, elected by the members in 2021 "
                "for a term of six years. She holds an open hour every Thursday from 16:00 in the "
                "reading room; no appointment is needed and no topic is too small.",
            ],
        ),
    ],
    [
        (
            "Working hours",
            [
                "The standard working week is 37 hours. Core hours are 10:00 to 15:00 from Monday "
                "to Thursday and 10:00 to 13:00 on Friday; outside core hours you may arrange your "
                "day as suits you and your team, provided the building is open. The head office "
                "opens at 07:30 and closes at 19:30. If you need to work later, ask the duty "
                "facilities officer for an evening pass the day before.",
                "The time recording system is called Tidemark; you will find it on the intranet "
                "start page. Please record your hours by the end of each week. Overtime must be "
                "agreed with your team lead in advance and may be taken either as paid hours or as "
                "time off in lieu, at your choice, within three months.",
            ],
        ),
        (
            "Working from home",
            [
                "Most roles may be done from home for up to two days a week. Survey staff, print "
                "room staff and the map library team are an exception, because their work depends "
                "on equipment or collections that cannot leave the building. Everyone is expected "
                "in the office on Wednesdays, which we call anchor day: team meetings, training "
                "sessions and the weekly all-hands briefing at 11:30 are held then.",
                "When working from home, keep your status in the chat tool up to date and make "
                "sure you can be reached by phone during core hours. The cooperative pays a "
                "home-working allowance of 18 EUR per month to cover electricity and internet, "
                "added automatically to your salary.",
            ],
        ),
        (
            "Probation and reviews",
            [
                "New employees serve a probation period of four months. Halfway through, you and "
                "your team lead meet to talk about how things are going; at the end, the "
                "probation review confirms your appointment. After probation, performance "
                "reviews take place twice a year, in March and in September. They are "
                "conversations, not examinations: come with questions, ideas and anything that "
                "gets in the way of your work.",
                "The mentoring scheme is called Compass Pairs. Every newcomer is paired with a "
                "colleague from another team. Your mentor is not your manager. Their job is "
                "to show you where things are, explain the unwritten rules and have lunch with "
                "you at least once a fortnight during your first three months.",
            ],
        ),
    ],
    [
        (
            "Pay",
            [
                "Salaries are paid monthly by bank transfer on the 25th day of each month. When "
                "the 25th falls on a weekend or a public holiday, payment is made on the last "
                "working day before it. Payslips are published in the Tidemark system two days "
                "before payday. Questions about pay go to the payroll officer, Jonas Abernethy, "
                "on extension 4102.",
                "Salary bands are published on the intranet and reviewed each January. Members "
                "of the cooperative receive their share of any surplus in a single payment with "
                "the June salary, after the annual general meeting has approved the accounts.",
            ],
        ),
        (
            "Annual leave",
            [
                "The annual leave allowance is 27 days for every full-time employee, plus public "
                "holidays. Part-time staff receive a proportional amount. After five years "
                "of service the allowance rises by one day, and after ten years by a further day. "
                "Up to five unused days may be carried over into the next year; they must be used "
                "by the end of April or they are lost.",
                "Request leave in Tidemark at least two weeks in advance for periods longer than "
                "three days. The office closes between Christmas and New Year; those three "
                "working days are a gift from the cooperative and are not taken from your "
                "allowance.",
            ],
        ),
        (
            "Sickness and other absence",
            [
                "If you are ill, call or message your team lead before 09:30 on the first day. "
                "For absences longer than five working days, a doctor's note is required. You "
                "may also take up to four days of paid family leave each year to care for a "
                "child, a partner or a parent, and two days of volunteering leave for work with "
                "a registered charity. Parental leave follows the national rules, and the "
                "cooperative tops up statutory pay to full salary for the first sixteen weeks.",
            ],
        ),
    ],
    [
        (
            "The head office",
            [
                "The rope warehouse has four floors. The ground floor holds reception, the print "
                "room and the loading bay. The first floor is the drawing office, where the "
                "cartographers and data team sit. The second floor has meeting rooms, the People "
                "Office and finance. The top floor, under the old roof beams, is home to the "
                "cafeteria. The cafeteria is called The Plumb Line, after the brass plumb bob "
                "that still hangs from the central beam.",
                "The Plumb Line serves breakfast from 08:00 to 09:30 and lunch from 12:00 to "
                "14:00. Lunch is subsidised: a main course costs 4 EUR for staff. There is always "
                "a vegetarian dish, and the kitchen will prepare other meals on request if you "
                "tell them the day before. Fruit, tea and coffee are free all day.",
            ],
        ),
        (
            "Network, desks and rooms",
            [
                "The staff wireless network is called OTTERLINE and its password changes on the "
                "first Monday of each quarter; the current password is shown on the screen next "
                "to reception. Visitors use the separate network BRACKWATER-GUEST, which has no "
                "access to internal systems.",
                "Desks in the drawing office are shared. Book a desk in the Tidemark system the "
                "day before, and leave it clear at the end of the day. Meeting rooms are named "
                "after lighthouses on our coast: Skerrow, Blackmoor Head, Pellan and Little "
                "Fastnet. The largest, Skerrow, seats twenty-four people and has a ceiling "
                "projector for map reviews.",
            ],
        ),
        (
            "Getting here",
            [
                "The head office has only nine car parking spaces, reserved for people with a "
                "disability, for pool vehicles and for visitors. Staff are encouraged to come by "
                "bus, train or bicycle. The cooperative pays 60 percent of the cost of an annual "
                "public transport pass. There is secure storage for forty bicycles in room G-07, "
                "next to the loading bay, together with showers and lockers. A bicycle repair "
                "stand and a pump are kept there as well.",
            ],
        ),
    ],
    [
        (
            "Information technology",
            [
                "Every employee receives a laptop on the first day, set up by the IT service "
                "desk. The service desk is on the first floor next to the drawing office and can "
                "be reached on extension 4417 or by e-mail at servicedesk@brackwater.example. It "
                "is staffed from 08:00 to 18:00 on working days. Outside those hours, urgent "
                "problems with the survey systems can be reported to the on-call engineer through "
                "the same number.",
                "Do not install software yourself; ask the service desk, which keeps a catalogue "
                "of approved programs, including the mapping suite, the chart checker and the "
                "office applications. Personal devices may be used for e-mail and chat only if "
                "they are enrolled in device management.",
            ],
        ),
        (
            "Information security",
            [
                "Our charts are used for navigation, so errors and tampering can put people at "
                "risk. The head of the Security team is Marta Quill, who reports directly to the "
                "managing director. Report anything suspicious to the Security team at once, "
                "even if you are not sure: an odd e-mail, a lost badge, a stranger in the drawing "
                "office or a file that has changed when it should not have.",
                "Passwords must be at least fourteen characters long and must not be reused for "
                "any other service. Two-factor sign-in is required for all systems. Lock your "
                "screen whenever you leave your desk; the Security team runs a friendly check "
                "every month and leaves a small paper gull on unlocked keyboards. Customer survey "
                "data must never be copied to personal storage or sent by personal e-mail.",
                "Your building badge opens the doors on the floors you need. Badges are blue for "
                "staff, orange for contractors and white for visitors. Lost badges are replaced "
                "at reception for a fee of 10 EUR.",
            ],
        ),
    ],
    [
        (
            "Health and safety",
            [
                "The health and safety coordinator is Priya Castellan, who also chairs the safety "
                "committee. Each floor has two trained first-aiders; their names and photographs "
                "are posted beside the lifts. First-aid kits are kept in the kitchen on each "
                "floor and in every vehicle at the Gannet Point depot. Report all accidents and "
                "near misses in the Tidemark system within one day, however small they seem.",
                "Field survey work has its own rules. Nobody works alone on the shore or on the "
                "water. Life jackets are worn on every boat at all times, and boat trips are "
                "cancelled when the wind forecast exceeds force 6. All field staff complete a "
                "sea survival course in their first year, paid for by the cooperative.",
            ],
        ),
        (
            "Fire and evacuation",
            [
                "If you hear the fire alarm, a continuous ringing bell, leave the building at "
                "once by the nearest exit. Do not use the lifts and do not stop to collect "
                "belongings. The assembly point for the head office is the copper sundial in "
                "Pellow Yard, across the road from the main entrance. Fire wardens wear yellow "
                "vests and will check that every floor is empty. Wait at the assembly point until "
                "a warden tells you that it is safe to return.",
                "The fire alarm is tested every Tuesday at 10:00 with a short ring of about ten "
                "seconds; no action is needed during the test. A full evacuation drill is held "
                "twice a year without warning.",
            ],
        ),
        (
            "Wellbeing",
            [
                "The cooperative offers every employee six free, confidential sessions a year "
                "with an independent counselling service. The quiet room on the second floor may "
                "be used for rest, prayer or a few minutes away from the screen. A rowing club, a "
                "choir and a Sunday walking group are run by staff volunteers, and new members "
                "are always welcome.",
            ],
        ),
    ],
    [
        (
            "Travel and expenses",
            [
                "Business travel is booked through the travel desk in the finance office, not by "
                "employees directly. Trains are preferred to flights for any journey under six "
                "hours. When travelling overnight you receive a daily meal allowance of 45 EUR, "
                "and hotels are booked up to a limit of 130 EUR per night, or 170 EUR in capital "
                "cities. Mileage for the use of a private car is paid at 0.30 EUR per kilometre.",
                "Submit expense claims in the Tidemark system within thirty days, with a "
                "photograph of each receipt. Claims are paid with the next salary. Expenses above "
                "500 EUR must be approved by the head of finance, Rufus Okonkwo, before they are "
                "incurred.",
            ],
        ),
        (
            "Conduct",
            [
                "We expect colleagues to treat each other, our customers and the public with "
                "courtesy. Harassment and discrimination of any kind are not tolerated. If you "
                "experience or witness behaviour that worries you, speak to your team lead, the "
                "People Office or a confidential adviser. Concerns about wrongdoing can also be "
                "raised anonymously through the integrity line, which is run by an outside firm.",
                "Gifts from customers or suppliers worth more than 25 EUR must be declared to the "
                "People Office. Employees who want to take on paid work outside the cooperative "
                "should discuss it with their team lead first, to avoid conflicts of interest.",
            ],
        ),
        (
            "Events and useful contacts",
            [
                "The annual general meeting of members is held on the second Saturday of May in "
                "the Corn Exchange in Tessaly Ford. The winter party takes place on 12 December "
                "2025 at the Gannet Point depot, with a boat to carry guests from the town "
                "harbour. Summer brings the Chart Day open house, when families and friends are "
                "invited to see how a chart is made from survey to print.",
                "Reception: extension 4000. People Office: extension 4120 (manager: Hamid "
                "Sorensen). Payroll: extension 4102. IT service desk: extension 4417. Security "
                "team: extension 4666. Facilities and building: extension 4300. In an emergency "
                "outside working hours, call the duty manager on 0555 019 284.",
            ],
        ),
    ],
]


class HandbookPDF(FPDF):
    """A4 pages with a running header (title) and footer (page numbers)."""

    def header(self) -> None:
        self.set_font("Helvetica", "I", 8)
        self.cell(0, 6, TITLE, align="C")
        self.ln(10)

    def footer(self) -> None:
        self.set_y(-14)
        self.set_font("Helvetica", "I", 8)
        self.cell(0, 6, f"Page {self.page_no()} of {{nb}} - for staff use only", align="C")


def build(out: Path = OUT) -> Path:
    """Write the handbook PDF to ``out`` and return the path."""
    pdf = HandbookPDF(format="A4")
    pdf.set_margins(20, 15, 20)
    pdf.set_auto_page_break(auto=True, margin=18)
    pdf.set_creator("sekv sample_docs generator")
    pdf.set_title(TITLE)
    pdf.set_creation_date(datetime(2025, 1, 6, tzinfo=timezone.utc))
    for number, sections in enumerate(PAGES, start=1):
        pdf.add_page()
        for heading, paragraphs in sections:
            pdf.set_font("Helvetica", "B", 12)
            pdf.cell(0, 7, heading, new_x="LMARGIN", new_y="NEXT")
            pdf.set_font("Helvetica", "", 10)
            for paragraph in paragraphs:
                pdf.multi_cell(0, 5, paragraph, new_x="LMARGIN", new_y="NEXT")
                pdf.ln(2)
            pdf.ln(2)
        if pdf.page_no() != number:
            raise RuntimeError(f"page {number} overflowed; shorten its text")
    out.parent.mkdir(parents=True, exist_ok=True)
    pdf.output(str(out))
    return out


if __name__ == "__main__":
    print(build())
